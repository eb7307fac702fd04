"""Weight-only quantization: int8 per output channel or in groups, int4 in groups, and int8 K/V.

Three modules, read in this order:

* `formats`: QuantConfig and the math of one weight (quantize / dequantize, int4 packing),
  int8 K/V, and the bytes each format stores. Lesson 10 is about this one.
* `checkpoint`: whole models: quantize a weight dict as it loads, save and load quantized folders.
* `report`: what it costs and saves: per-layer rounding error and histograms, the
  weight-memory table.

Every public name is importable from `tinyinfer.quant` itself.
"""

from tinyinfer.quant.checkpoint import (CONFIG_FILE, FORMAT, load_quantized, quantize_weights,
                                        read_quant_config, save_quantized)
from tinyinfer.quant.formats import (BITS, GROUP_SIZES, HEAD_NAMES, HEAD_SUFFIX, LINEAR_NAMES, MIN_BYTES, SCALE_BYTES, ZERO_POINT_BYTES,
                                     QuantConfig, QuantizationError, QuantizedWeight, codes_and_zeros,
                                     concat_out, dequantize, dequantize_kv, dequantize_rows, group_offsets,
                                     is_quantized_name, pack_int4, quantize, quantize_kv, stored_codes,
                                     take_rows, unpack_int4)
from tinyinfer.quant.report import (BINS, MEMORY_FORMATS, ErrorReport, Histogram, LayerError, MemoryRow,
                                    error_histograms, error_report, format_memory_table, histogram,
                                    layer_error, layer_errors, memory_row, weight_memory_table,
                                    weights_nbytes)

__all__ = [
    "BINS", "BITS", "CONFIG_FILE", "FORMAT", "GROUP_SIZES", "HEAD_NAMES", "HEAD_SUFFIX", "LINEAR_NAMES", "MEMORY_FORMATS", "MIN_BYTES",
    "SCALE_BYTES", "ZERO_POINT_BYTES", "ErrorReport", "Histogram", "LayerError", "MemoryRow",
    "QuantConfig", "QuantizationError", "QuantizedWeight", "codes_and_zeros", "concat_out",
    "dequantize", "dequantize_kv", "dequantize_rows", "error_histograms", "error_report", "format_memory_table", "group_offsets",
    "histogram", "is_quantized_name", "layer_error", "layer_errors", "load_quantized", "memory_row",
    "pack_int4", "quantize", "quantize_kv", "quantize_weights", "read_quant_config",
    "save_quantized", "stored_codes", "take_rows", "unpack_int4", "weight_memory_table", "weights_nbytes",
]
