"""Models trained by headatlas itself, whose heads' answers are known (the toy induction series)."""
