"""The project's tests: unit/ (in-process, one folder per library package), integration/ (real processes), helpers/."""
