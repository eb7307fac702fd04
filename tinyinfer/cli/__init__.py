"""The `tinyinfer` command: one module per front end (commands: generate, info, bench;
serve, simulate, quantize, lesson), and what they share (common)."""
