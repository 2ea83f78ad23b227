"""Results of the project's runs: the comparison step (`results.compare`) and committed studies."""
