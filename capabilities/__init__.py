"""portlayer.capabilities: descriptors (what a device can do), probing, and the policy (what to do)."""

from portlayer.capabilities.descriptor import Descriptor, DescriptorError, list_descriptors, load_descriptor
from portlayer.capabilities.plan import Decision, Plan, PlanError
from portlayer.capabilities.policy import negotiate, plan_for_graph
from portlayer.capabilities.probe import DetectedDevice, default_target, probe_devices
from portlayer.capabilities.requirements import ModelRequirements

__all__ = [
    "Decision", "Descriptor", "DescriptorError", "DetectedDevice", "ModelRequirements", "Plan", "PlanError",
    "default_target", "list_descriptors", "load_descriptor", "negotiate", "plan_for_graph", "probe_devices",
]  # fmt: skip
