"""The local testbed that calibration and validation share: torchrun launches on this host or on
emulated nodes (network namespaces joined by tc-shaped veth links), the processes they start and
always stop, and torch modules built from a model's shapes."""
