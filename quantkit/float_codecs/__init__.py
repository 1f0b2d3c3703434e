"""Float quantization grids (#47): E2M1 (FP4) elements, E4M3 (FP8) values and scales, E8M0 power-of-two scales,
and the weight schemes built from them (FP8 per tensor/channel/128x128 block, MXFP8, NVFP4, MXFP4).

Each module follows the format's definition in plain PyTorch, with the scale rules compressed-tensors 0.20.1
uses (so a checkpoint quantkit writes dequantizes identically there); the tests compare against
compressed-tensors' own functions.  Checkpoint layouts are in `quantkit.formats.ct_*`.
"""
