"""mixquant.keys"""
