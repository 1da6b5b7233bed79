"""Op definitions; importing a module registers its ops."""
