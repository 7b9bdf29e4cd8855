// Empty translation unit: libhsbn_bn_bench.so exists to carry the whole hsbn_kernels archive
// (and so the hsbn_bn_* C ABI) into a shared library that torch_compare.py loads with ctypes.
