"""starqa's compiled CPU kernels (the C sources in this folder, their boundary declared in
_kernels.h, built as one optional library by `build`): `kernels` binds them through ctypes
without torch, `ops` calls them on torch tensors."""
