"""Training data: Megatron indexed datasets (``.bin``/``.idx``), GPT samples in Megatron-LM's order,
tokenizers and preprocessing. The bundled training text ``sample_corpus.txt`` (``--data-path bundled``) lives here too."""
