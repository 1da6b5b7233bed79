#!/usr/bin/env bash
# Source this on a machine where portlayer is not pip-installed (the lent H200 has no
# network): it makes `import portlayer` work from this checkout through a folder of
# symlinks that mirrors setup.cfg's package_dir mapping.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
site="${PORTLAYER_SITE:-/tmp/portlayer-site}"
mkdir -p "$site/portlayer"
for f in "$root"/portlayer/*; do ln -sfn "$f" "$site/portlayer/$(basename "$f")"; done
for d in flatten passes backends codegen runtime capabilities; do ln -sfn "$root/$d" "$site/portlayer/$d"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
