"""Flat Model IR: capture, ops, printing, serialisation, verification, interpretation."""

from portlayer.flatten.capture import CaptureError, capture
from portlayer.flatten.interpret import ExecContext, interpret, run_graph
from portlayer.flatten.ir import Graph, GraphBuilder, Node, TensorType, Value

__all__ = [
    "CaptureError", "ExecContext", "Graph", "GraphBuilder", "Node", "TensorType", "Value",
    "capture", "interpret", "run_graph",
]
