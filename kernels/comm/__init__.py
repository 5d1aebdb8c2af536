"""Communication kernels for data-parallel training: gradient compressors and Linear Pipelining collectives."""
