"""The grouping tier (``rollstream grouping``): gathers each prompt's samples into a group, drops or emits it."""
