"""starqa's compiled CPU kernels (the C sources in this folder, built as one optional
library): `kernels` binds them through ctypes without torch, `ops` calls them on torch tensors."""
