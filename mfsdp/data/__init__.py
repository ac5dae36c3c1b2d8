"""Training data: Megatron indexed datasets (``.bin``/``.idx``), GPT samples in Megatron-LM's order,
tokenizers and preprocessing. The bundled corpus ``fsdp_notes.txt`` lives here too."""
