"""What runs beside training: the `Controller` that owns the plan and its codecs, the adaptive
re-planning behind plan "auto", agreement across ranks, and where our log lines go."""
