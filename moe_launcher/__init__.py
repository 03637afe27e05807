"""The launcher's own pieces: platform defaults, data, the GPT forward step and the model spec."""
