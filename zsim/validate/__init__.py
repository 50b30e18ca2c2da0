"""Validation: real DeepSpeed training measured, the same cases simulated, one plotted against
the other; multi-node clusters emulated on one machine with network namespaces and tc."""
