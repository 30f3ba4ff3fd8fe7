"""What users see of a stored run: queries, intervals, comparisons, head roles, figures, reports,
exports, and one text inspected."""
