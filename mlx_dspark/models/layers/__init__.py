"""Draft layer families (`qwen3`, `spark2_5`, `gemma4`: ModelArgs, Attention, MLP, Norm), the parts they share (`base`) and the layer-type names (`layer_types`). Imports nothing above models/."""
