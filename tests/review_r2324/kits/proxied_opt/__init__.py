"""A kit laid out for the original launcher: package <kit>_opt, a modes module, no stack."""
