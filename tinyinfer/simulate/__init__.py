"""The roofline cost model. It depends on model configs and hardware presets only, never on the
engine: model (simulate a scenario), memory, steps, quantity (numbers that explain
themselves), presets, and the fits of its efficiency terms to measurements (calibrate,
calibrate_tp)."""
