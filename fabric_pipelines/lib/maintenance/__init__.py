"""Verify, repair and forget: checks over everything stored and the fixes they name; imports index, results and below."""
