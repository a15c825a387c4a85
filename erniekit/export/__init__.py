"""Export trained models to deployable layouts."""
