"""llama.cpp's GGUF, in one package: everything quantkit reads and writes as GGUF.

    types      llama.cpp's tensor types (Q4_0 ... Q6_K, F16) and file-type mixes, as plain data
    blocks     one tensor's blocks packed / unpacked (ggml-common.h's block_* layouts)
    container  the GGUF container: header, metadata and tensor table read strictly (untrusted input)
    file_io    a model's tensors written to / read from a GGUF file (llama names, q/k permutation, tokenizer)
    plan       which llama.cpp type each tensor gets (llama-quantize's mixes and fallbacks)
    export     a quantized model written as a GGUF checkpoint folder (file, config, card)
    source     a .gguf file loaded as a full-precision transformers model (a quantization source)

The format's entry in quantkit's registry (what GGUF can store) is `quantkit.formats.registry.GgufFormat`.
"""
