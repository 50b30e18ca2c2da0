"""One training step: the program of each rank (DeepSpeed ZeRO 0-3, its ZeRO-3 coordinator,
DeepSpeed's and Megatron's pipelines, Megatron's TP), the simpy engine that runs the programs on
the network, and the spans it records turned into metrics and traces."""
