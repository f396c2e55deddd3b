"""lmcli's native CPU kernels: int8-quantized activations x GGUF block weights (every block format
of ``formats.h``: q4_0 ... q8_0, the K-quants, iq4_nl, iq4_xs, mxfp4), with the instruction set
picked at run time, and a whole block's decoding step in one call.

``ops.BoundProduct`` is the product (every size checked before the kernel runs), ``ops.backend_line``
says in one line which path products take, ``blocks`` quantizes to GGUF blocks (every format
llama-quantize writes, byte for byte ggml's; ``quantize.cpp``) and reads them back, ``abi`` binds
the library and checks it against what lmcli expects, ``layer`` is the one-call step; the
layer that holds a weight as its blocks is ``lmcli.model.quant.BlockLinear``.
Build ahead with ``python -m lmcli.model.native build``; otherwise the first use builds it, and
without a compiler (or with ``LMCLI_NATIVE=0``) callers take torch's path.
"""
