"""What the dashboard pages show (data and figures, one module per page) and the server launcher."""
