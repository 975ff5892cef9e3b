"""Modal screens: model loading progress, dialogs, pickers."""
