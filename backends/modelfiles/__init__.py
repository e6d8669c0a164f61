"""Model files: the presets, the files found in place (library), the Hugging Face Hub, what a source names
(resolution: a preset, a local file or folder, a Hugging Face id -> a local path). Read, never loaded: a
load's progress is backends.load_progress's."""
