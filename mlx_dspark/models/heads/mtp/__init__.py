"""The target's own multi-token-prediction layers, one module per family (Qwen3.5, Qwen3-Next, DeepSeek-V3 / GLM, MiMo, Nemotron-H) over what they share (`layers`)."""
