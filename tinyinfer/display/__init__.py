"""Terminal output shared by the commands: progress bars, tables and text bar plots."""
