"""DeepSeek-V3 MoE layer (expert parallel): dispatch, SwiGLU experts, combine."""
