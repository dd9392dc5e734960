"""Slack routing, one feature: each engine's agent pushes its state to the
app's state board (board.py); each ingress's request router long-polls the
board and ranks engines by buffer slack (ranking.py, request_router.py)."""
