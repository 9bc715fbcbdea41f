"""Measuring the device: CPU probe, memory bandwidth, calibration, device profiles."""
