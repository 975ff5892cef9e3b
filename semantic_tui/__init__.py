"""semantic's terminal workbench (Textual) and its command line."""
