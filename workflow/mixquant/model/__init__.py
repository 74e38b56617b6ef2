"""mixquant.model"""
