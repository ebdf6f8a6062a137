"""Verify, repair and forget: checks over everything stored and the repairs they name. Imports
index, results and the floors below them."""
