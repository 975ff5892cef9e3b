"""The ``semantic`` command: the workbench, headless serving (``--serve``), and model and agent utilities."""
