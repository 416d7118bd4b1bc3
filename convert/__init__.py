"""`python -m convert`: command-line front end of `mlx_encoders.conversion.convert`."""
