"""The workload: what is trained (model shapes, their kernels and activations) and how it is laid
out (parallel sizes, ZeRO stage, batch, DeepSpeed's knobs, which layers a pipeline rank holds)."""
