"""Test and benchmark harnesses (fault drills, scratch databases); outside the wheel, never imported by the product."""
