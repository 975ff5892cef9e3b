"""The workbench's widgets, one per module."""
