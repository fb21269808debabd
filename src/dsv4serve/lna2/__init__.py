"""lna2: dsv4serve's own EXL3 routed-expert decode kernel (CUDA) and its pure-PyTorch reference."""
