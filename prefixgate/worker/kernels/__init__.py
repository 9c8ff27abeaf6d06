"""GPU kernels of the worker (Triton). Each has a torch reference path elsewhere; the
kernels are optional and imported only when used."""
