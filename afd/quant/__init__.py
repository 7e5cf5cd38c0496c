"""Quantized weights and activations: which scheme a model serves with (scheme), the tensor math of each
format (formats), and the reference kernels every backend falls back to (reference). The modules that hold
quantized weights are afd.model.quant_layers; the backends' fast kernels are Backend.quant_matmul and
Backend.quant_grouped_matmul."""
