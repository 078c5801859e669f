"""The optimizer kernels behind the functional entries: one dispatcher, the native C++ kernels, the compiled and eager Adam, the reference kernels, quantization and stochastic rounding."""
