"""mixquant.source"""
