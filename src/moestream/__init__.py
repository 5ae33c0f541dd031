"""moestream"""
