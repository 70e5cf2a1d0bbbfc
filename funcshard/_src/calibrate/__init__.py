"""Measuring a machine for the planner: ``funcshard calibrate``."""
