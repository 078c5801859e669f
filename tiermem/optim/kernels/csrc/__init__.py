"""The C++ sources of the native kernels, as Python strings (tiermem/optim/kernels/native.py builds them)."""
