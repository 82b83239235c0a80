"""The core: dispatch (portable or native kernels, traces), argument checks, array helpers."""
