"""lmcli's native CPU kernels: int8-quantized activations x GGUF block weights (q8_0, q4_0, q4_K,
q5_K, q6_K), with the instruction set picked at run time, and a linear layer holding such blocks.

``ops.matmul`` is the product (every size checked before the kernel runs), ``ops.backend_line``
says in one line which path products take, ``blocks`` quantizes to GGUF blocks (every format
llama-quantize writes, byte for byte ggml's; ``quantize.cpp``) and reads them back; the
layer that holds a weight as its blocks is ``lmcli.model.quant.BlockLinear``.
Build ahead with ``python -m lmcli.model.native build``; otherwise the first use builds it, and
without a compiler (or with ``LMCLI_NATIVE=0``) callers take torch's path.
"""
